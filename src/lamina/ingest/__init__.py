"""Ingestion: sources read upstream systems in their own offsets; reclocked into relations.

See docs/ingestion.md.
"""
