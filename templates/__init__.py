"""Jinja2 templates of the rendered manifests (a package so they ship inside the wheel)."""
