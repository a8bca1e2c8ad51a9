"""Grant types of the token endpoint, one module each, behind one dispatcher (base.py)."""
