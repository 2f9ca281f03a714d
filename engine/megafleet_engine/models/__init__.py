"""Model builders the engine can load without any download (tiny test models built in code)."""
