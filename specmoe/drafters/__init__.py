"""specmoe.drafters"""
