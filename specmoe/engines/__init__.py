"""specmoe.engines"""
