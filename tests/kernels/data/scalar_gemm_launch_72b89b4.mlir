// gemm M=16 K=576 N=576: herd 2x4, tiles m8 n48 k32 (L1) k64 (L2), 1x3 launch steps
%c1 = arith.constant 1 : index
%c3 = arith.constant 3 : index
air.launch @gemm (%lx, %ly) in (%lsx=%c1, %lsy=%c3) args(%a=%operand0, %w=%operand1, %c=%operand2) : memref<16x576xbf16>, memref<576x576xbf16>, memref<16x576xbf16> {
  air.segment @gemm_seg args(%lx_2=%lx, %ly_2=%ly, %a_2=%a, %w_2=%w, %c_2=%c) : index, index, memref<16x576xbf16>, memref<576x576xbf16>, memref<16x576xbf16> {
    %row0 = affine.apply affine_map<()[s0] -> (s0 * 16)>()[%lx_2]
    %col0 = affine.apply affine_map<()[s0] -> (s0 * 192)>()[%ly_2]
    %a_l2 = memref.alloc() : memref<16x64xbf16, 1 : i32>
    %w_l2 = memref.alloc() : memref<192x64xbf16, 1 : i32>
    %c_l2 = memref.alloc() : memref<16x192xbf16, 1 : i32>
    %acc_l1 = memref.alloc() : memref<2x4x8x48xf32, 2 : i32>
    %c2 = arith.constant 2 : index
    %c4 = arith.constant 4 : index
    air.herd @gemm_herd tile (%hx, %hy) in (%hsx=%c2, %hsy=%c4) args(%acc_l1_2=%acc_l1) : memref<2x4x8x48xf32, 2 : i32> {
      %slab = memref.subview %acc_l1_2[%hx, %hy, 0, 0] [1, 1, 8, 48] [1, 1, 1, 1] : memref<2x4x8x48xf32, 2 : i32> to memref<8x48xf32, strided<[48, 1], offset: ?>, 2 : i32>
      %cst_f32 = arith.constant 0.000000000e+00 : f32
      linalg.fill ins(%cst_f32 : f32) outs(%slab : memref<8x48xf32, strided<[48, 1], offset: ?>, 2 : i32>)
    }
    %c0 = arith.constant 0 : index
    %c9 = arith.constant 9 : index
    %c1_2 = arith.constant 1 : index
    scf.for %k2_trip = %c0 to %c9 step %c1_2 {
      %k2 = affine.apply affine_map<()[s0] -> (s0 * 64 + 0)>()[%k2_trip]
      %c16 = arith.constant 16 : index
      %c64 = arith.constant 64 : index
      %c576 = arith.constant 576 : index
      air.dma_memcpy_nd (%a_l2[] [] [], %a_2[%row0, %k2] [%c16, %c64] [%c576, %c1_2]) : (memref<16x64xbf16, 1 : i32>, memref<16x576xbf16>)
      %c192 = arith.constant 192 : index
      air.dma_memcpy_nd (%w_l2[] [] [], %w_2[%col0, %k2] [%c192, %c64] [%c576, %c1_2]) : (memref<192x64xbf16, 1 : i32>, memref<576x576xbf16>)
      air.herd @gemm_herd tile (%hx_2, %hy_2) in (%hsx_2=%c2, %hsy_2=%c4) args(%a_l2_2=%a_l2, %w_l2_2=%w_l2, %acc_l1_3=%acc_l1) : memref<16x64xbf16, 1 : i32>, memref<192x64xbf16, 1 : i32>, memref<2x4x8x48xf32, 2 : i32> {
        %a_l1 = memref.alloc() : memref<8x32xbf16, 2 : i32>
        %w_l1 = memref.alloc() : memref<48x32xbf16, 2 : i32>
        %slab_2 = memref.subview %acc_l1_3[%hx_2, %hy_2, 0, 0] [1, 1, 8, 48] [1, 1, 1, 1] : memref<2x4x8x48xf32, 2 : i32> to memref<8x48xf32, strided<[48, 1], offset: ?>, 2 : i32>
        %a_row = affine.apply affine_map<()[s0] -> (s0 * 8)>()[%hx_2]
        %w_row = affine.apply affine_map<()[s0] -> (s0 * 48)>()[%hy_2]
        %c0_2 = arith.constant 0 : index
        %c2_2 = arith.constant 2 : index
        %c1_3 = arith.constant 1 : index
        scf.for %k1_trip = %c0_2 to %c2_2 step %c1_3 {
          %k1 = affine.apply affine_map<()[s0] -> (s0 * 32 + 0)>()[%k1_trip]
          %c8 = arith.constant 8 : index
          %c32 = arith.constant 32 : index
          %c64_2 = arith.constant 64 : index
          air.dma_memcpy_nd (%a_l1[] [] [], %a_l2_2[%a_row, %k1] [%c8, %c32] [%c64_2, %c1_3]) : (memref<8x32xbf16, 2 : i32>, memref<16x64xbf16, 1 : i32>)
          %c48 = arith.constant 48 : index
          air.dma_memcpy_nd (%w_l1[] [] [], %w_l2_2[%w_row, %k1] [%c48, %c32] [%c64_2, %c1_3]) : (memref<48x32xbf16, 2 : i32>, memref<192x64xbf16, 1 : i32>)
          linalg.matmul indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>] ins(%a_l1, %w_l1 : memref<8x32xbf16, 2 : i32>, memref<48x32xbf16, 2 : i32>) outs(%slab_2 : memref<8x48xf32, strided<[48, 1], offset: ?>, 2 : i32>)
        }
        memref.dealloc %a_l1 : memref<8x32xbf16, 2 : i32>
        memref.dealloc %w_l1 : memref<48x32xbf16, 2 : i32>
      }
    }
    air.herd @gemm_herd tile (%hx_3, %hy_3) in (%hsx_3=%c2, %hsy_3=%c4) args(%acc_l1_4=%acc_l1, %c_l2_2=%c_l2) : memref<2x4x8x48xf32, 2 : i32>, memref<16x192xbf16, 1 : i32> {
      %slab_3 = memref.subview %acc_l1_4[%hx_3, %hy_3, 0, 0] [1, 1, 8, 48] [1, 1, 1, 1] : memref<2x4x8x48xf32, 2 : i32> to memref<8x48xf32, strided<[48, 1], offset: ?>, 2 : i32>
      %c_l1 = memref.alloc() : memref<8x48xbf16, 2 : i32>
      linalg.generic {indexing_maps = [affine_map<(d0, d1) -> (d0, d1)>, affine_map<(d0, d1) -> (d0, d1)>], iterator_types = ["parallel", "parallel"]} ins(%slab_3 : memref<8x48xf32, strided<[48, 1], offset: ?>, 2 : i32>) outs(%c_l1 : memref<8x48xbf16, 2 : i32>) {
      ^bb0(%in: f32, %out: bf16):
        %rounded = arith.truncf %in : f32 to bf16
        linalg.yield %rounded : bf16
      }
      %c_row = affine.apply affine_map<()[s0] -> (s0 * 8)>()[%hx_3]
      %c_col = affine.apply affine_map<()[s0] -> (s0 * 48)>()[%hy_3]
      %c8_2 = arith.constant 8 : index
      %c48_2 = arith.constant 48 : index
      %c192_2 = arith.constant 192 : index
      %c1_4 = arith.constant 1 : index
      air.dma_memcpy_nd (%c_l2_2[%c_row, %c_col] [%c8_2, %c48_2] [%c192_2, %c1_4], %c_l1[] [] []) : (memref<16x192xbf16, 1 : i32>, memref<8x48xbf16, 2 : i32>)
      memref.dealloc %c_l1 : memref<8x48xbf16, 2 : i32>
    }
    %c16_2 = arith.constant 16 : index
    %c192_3 = arith.constant 192 : index
    %c576_2 = arith.constant 576 : index
    air.dma_memcpy_nd (%c_2[%row0, %col0] [%c16_2, %c192_3] [%c576_2, %c1_2], %c_l2[] [] []) : (memref<16x576xbf16>, memref<16x192xbf16, 1 : i32>)
    memref.dealloc %a_l2 : memref<16x64xbf16, 1 : i32>
    memref.dealloc %w_l2 : memref<192x64xbf16, 1 : i32>
    memref.dealloc %c_l2 : memref<16x192xbf16, 1 : i32>
    memref.dealloc %acc_l1 : memref<2x4x8x48xf32, 2 : i32>
  }
}