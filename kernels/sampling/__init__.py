"""The sampled next token: the penalties, top_k's candidates, the temperature's softmax, min_p, top_p and the draw,
in one launch."""
