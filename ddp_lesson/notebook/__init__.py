"""Notebook side: draws and teaches (widgets, plots, diagrams, lesson helpers, the %%ranks
magics). It may import both other sides."""
