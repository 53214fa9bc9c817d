"""The layout planner for clusters we cannot rent (``megalith plan``)."""
