"""specmoe.models"""
