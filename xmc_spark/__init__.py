"""xmc-spark: extreme multi-label classification on Apache Spark."""
__version__ = "0.1.0"
