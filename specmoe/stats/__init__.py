"""specmoe.stats"""
