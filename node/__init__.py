"""A pipeline node: the stage runtime (main, stage_node, compute, config) and its wings transport/, membership/, api/,
observe/."""
