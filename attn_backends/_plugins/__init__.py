"""How backends arrive: the pluggy hook, the registry, isolation of plugin code, policy."""
