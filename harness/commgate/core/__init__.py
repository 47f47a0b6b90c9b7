"""Layer 0, below everything: one-line errors, atomic files and the one JSON document reader, the
published schemas, units for humans, and provenance (versions, hardware). Imports nothing of commgate."""
