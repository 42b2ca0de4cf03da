"""specmoe.offload"""
