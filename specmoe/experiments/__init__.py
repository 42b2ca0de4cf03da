"""specmoe.experiments"""
