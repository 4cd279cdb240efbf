"""Values and machine facts: specs, batch metadata, features, RoPE scaling, platforms, errors and
reasons. Nothing here runs attention.
"""
