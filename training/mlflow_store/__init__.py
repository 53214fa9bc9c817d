"""MLflow as training and the stages above it use it: the tracking store and run logger (runs), reading a registered model version back from a models:/ URI (registered)."""
