"""NAT traversal: circuit relay v2 (hop and stop), and the lab's peers behind NAT."""
