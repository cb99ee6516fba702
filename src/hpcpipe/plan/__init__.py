"""The planner: profile the model, then choose layout, schedule and stage cut under a memory budget."""
