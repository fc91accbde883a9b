#pragma once
// Device lanes (private; Note [Device lanes] in pipemat/comm/device_lane.h): the list encoding
// tensor_list.cpp shares with device_lane.cpp, and the lane's side of send_tensors/recv_tensors.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "pipemat/comm/device_lane.h"

namespace pipemat::comm::detail {

// A tensor list as a message: spans over the headers and host data that `owned` keeps alive,
// `total` bytes in all. With a link, its entries the link carries are flagged kFlagOnLane, have
// no data block, and are in `carried` (contiguous), in list order; the header is a lane's.
struct ListMessage {
  std::vector<ConstSpan> spans;
  std::shared_ptr<const void> owned;
  uint64_t total = 0;
  std::vector<at::Tensor> carried;
};
// Checks the entries (ConfigError naming the entry) and encodes them (tensor_list.cpp).
ListMessage encode_list(const std::vector<at::Tensor>& tensors, int sender, int peer, int tag,
                        const LaneLink* link);

// send_tensors / recv_tensors on a transport with a lane (device_lane.cpp).
TensorListWork lane_send(DeviceLane& lane, Transport& transport, int peer, int tag,
                         const std::vector<at::Tensor>& tensors);
TensorListWork lane_recv(DeviceLane& lane, Transport& transport, int peer, int tag);

}  // namespace pipemat::comm::detail
