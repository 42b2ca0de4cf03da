"""specmoe.verifiers"""
