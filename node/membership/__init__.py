"""Who is in the cluster: SWIM-lite membership (gossip.py the pure rules, swim.py the trio driver)."""
