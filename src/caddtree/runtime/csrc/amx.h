// What the AMX paths of the AVX512-BF16 build share (linear_bf16.cpp, attention_bf16.cpp): whether
// this process may use the tile unit, and the tile configuration (palette 1, every tile 64 bytes
// wide; all 16 rows, or as many as a call of the linear kernel has), which each loads before its
// tiles, so that neither needs to know what the other left loaded.
//
// The roles of the eight tiles, the same wherever the kernels allow (a product is C += A x B):
//   tiles 0-3  C, float32 accumulators [16][16]: four output blocks at a time;
//   tiles 4-5  A, the left operands [16 rows][32 bfloat16]: input rows (linear), cached keys
//              (scores), probabilities in their hi and lo halves (values, tile 4 only);
//   tiles 6-7  B, the right operands [16 pairs][16 dwords]: a weight group's two halves
//              (linear), the queries' dim pairs (scores), value columns (values, which use tile 5
//              as a third B tile since they need one A tile only).
// The kernels name the tiles by these numbers; a comment where a tile is loaded says what it holds.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace caddtree_amx {

constexpr int64_t kTileRows = 16;  // rows of a tile
constexpr int64_t kChunk = 32;     // bfloat16 columns of an A tile (16 pairs)

// Once per process: the CPU has AMX-TILE and AMX-BF16, Linux grants the tile state
// (arch_prctl(ARCH_REQ_XCOMP_PERM)), and CADDTREE_AMX is not "0". Defined in linear_bf16.cpp.
bool amx_allowed();

struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile t holds rows[t] rows (each of 64 bytes).
[[gnu::target("amx-tile")]] inline void load_tile_rows(const uint8_t (&rows)[8]) {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = rows[t];
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Every tile 16 rows.
[[gnu::target("amx-tile")]] inline void load_tile_config() {
  const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  load_tile_rows(rows);
}

}  // namespace caddtree_amx
