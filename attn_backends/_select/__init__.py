"""How backends arrive and which one runs: the plugin hook and registry, the ranking table, the
selector and its record, the strict-mode canary, agreement across ranks, and warm-up.
"""
