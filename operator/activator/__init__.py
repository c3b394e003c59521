"""The activator: holds requests for services scaled to zero until a replica is Ready."""
