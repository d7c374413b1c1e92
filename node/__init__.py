"""Pipeline node: SWIM-lite membership (gossip.py pure rules, swim.py trio driver)."""
