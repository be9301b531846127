"""Versioned wire protocols (sans-IO codecs plus thin trio drivers). Never imports torch."""
