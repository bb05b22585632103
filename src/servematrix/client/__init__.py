"""The load generator: requests out, streamed tokens back, as trace rows."""
