"""specmoe.harness"""
