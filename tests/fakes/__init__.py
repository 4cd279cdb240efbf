"""Stand-ins for GPU libraries, so backends that need them can be tested on a CPU machine.

Each fake mirrors the real library's call signatures and argument checks and computes its
results with torch, so a backend run through it gives real numbers to compare.
"""
