"""HTTP endpoints, one module each, thin: parse the request, call the domain, render."""
