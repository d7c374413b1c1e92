"""The socket edge: HTTP app and client, link streams and frames, the wire, hypercorn's guards, who may call what."""
