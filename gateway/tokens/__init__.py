"""Token mode: render requests as the replica does, tokenize them, hash its blocks."""
