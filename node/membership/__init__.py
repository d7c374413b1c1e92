"""Who is in the cluster: SWIM-lite membership (gossip.py what members say, rules.py what a view makes of it,
swim_state.py one member's state and its pure steps, swim.py the trio driver)."""
