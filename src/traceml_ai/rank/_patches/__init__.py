"""Every torch patch of the rank, each reporting to what it is handed.

``phase_hooks`` (forward, backward, optimizer and DataLoader hooks, reporting to the
active step timer), ``wrappers`` (0.5.0's ``wrap_*`` helpers and the host-to-device
copy patch), ``distributed`` (``torch.distributed``'s collectives and ``Work.wait``,
reporting to the active collectives' recorder) and ``ddp`` (DDP's communication hook).
The patches import the timing core and the recorder; neither imports them.
"""
