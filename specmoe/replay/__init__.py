"""specmoe.replay"""
