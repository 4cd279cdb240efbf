"""The decision and its record: the request, the selector, the strict-mode canary, ranks and warm-
up.
"""
