"""The chaos controller: a FastAPI service that runs experiments and faults against one target and exports what it
did (``kvstorm chaos serve``)."""
