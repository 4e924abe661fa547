// Shared-memory link tests (segment sizing, values read from the peer): being written.
