"""Isolated execution of untrusted code, and math answer checking."""
