"""`dflash2 rehearse`: a GPU recipe run on this machine, at tiny widths, before any GPU is rented."""
