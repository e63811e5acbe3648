"""Frames on sockets: `channel` (one framed connection, fds included), `frame_reader` and
`fd_inbox` (its bounded reads), `tcplink` (a link across hosts). What the frames mean is
common.protocol's; the wire never imports the transfer."""
