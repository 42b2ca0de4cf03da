"""specmoe.kernels"""
