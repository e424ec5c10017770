"""The prefix cache's content hash of an image or video: two lanes of wrapping sums over a tensor's words."""
