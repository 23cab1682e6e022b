"""The control topic: its reader, the gate that admits signed commands, its compacted history and the fleet's audit chores."""
