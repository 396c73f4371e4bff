"""The stored forms a backend reads (Arrow files, raw shards): their layout, their conversion and its engines."""
