// Test helper: which local addresses listen on a TCP port, read from /proc/net/tcp{,6}.
#pragma once

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

namespace pipetrain::testing {

// The local addresses of the TCP sockets listening on `port`, as the kernel writes them, each followed
// by a space: "0100007F" is 127.0.0.1, "00000000" every IPv4 address, 32 zeros every IPv6 one.
inline std::string listening_addresses(int port) {
  std::string found;
  char port_hex[8];
  std::snprintf(port_hex, sizeof port_hex, "%04X", port);
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const auto colon = local.find(':');
      if (state == "0A" && colon != std::string::npos && local.substr(colon + 1) == port_hex)
        found += local.substr(0, colon) + " ";
    }
  }
  return found;
}

}  // namespace pipetrain::testing
