"""The benchmark sections: each module turns a profile into the Steps that measure it."""
