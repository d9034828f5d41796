"""Stage timers, CPU monitoring, metrics files and loggers."""
