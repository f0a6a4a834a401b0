"""The machinery of one experiment run: the runner behind ``kvstorm chaos run``, the run's shared state and live
progress line, the loads and the scrapes around them, and the measurement that sizes a load from its target."""
