"""Data: import captioned images into shards, the synthetic stream, its manifest and the streaming loader."""
