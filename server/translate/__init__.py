"""Pure translators between wire dialects and the internal types, named by direction."""
