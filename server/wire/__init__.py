"""The wire, at the bottom: bytes in as lines, replies and deliveries out as bytes owed to a client."""
