"""What a backend is: the base class, the protocol, capabilities and their validation, kernel
modules, and the float64 oracle.
"""
