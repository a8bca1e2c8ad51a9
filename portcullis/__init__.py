"""Shared kernel of Portcullis: configuration files, HTTP helpers and the process runtime.

It imports neither the gateway nor the authserver and holds no OAuth logic.
"""
